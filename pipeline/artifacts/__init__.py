"""One owner per folder of ``data/``: each module writes its artifact, reads it back typed, and verifies it."""
