"""One checks file per chapter, `chNN.py`: top-level `check_<claim>(module)` functions that raise
when the module under test gets something wrong. `exercises.run_checks` finds and runs them."""
