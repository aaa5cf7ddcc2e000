"""The command line: a recipe's config composed and checked (``config``, ``option_checks``), ``hf://`` values
downloaded from the hub (``hub``), object-store inputs copied locally (``run_config``), bad input reported in one
line (``command``), and what every recipe's ``main`` does around its training loop (``entry``)."""
