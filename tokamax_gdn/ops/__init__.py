"""One folder per op; one module per implementation (see `tokamax_gdn.registry`)."""
