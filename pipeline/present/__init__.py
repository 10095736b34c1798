"""Pure renderers: the verdict in words, the report page, the figures."""
