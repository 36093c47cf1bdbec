"""The ``lightning-zero`` command line: fit/validate/test/predict, estimate, consolidate."""
