"""Pure statistics of a trial against the reference, over chunks of rows: no file I/O, no MLflow."""
