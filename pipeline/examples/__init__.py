"""Built-in tasks. Their data ships inside installed packages: nothing is downloaded at run time."""
