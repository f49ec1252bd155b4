"""One checks file per chapter, `chNN.py`: top-level `check_<claim>(module)` functions that raise
when the module under test gets something wrong. `exercises.run_checks` finds and runs them."""


def raises(fn, error: type[Exception]) -> bool:
    """Does calling `fn()` raise `error`? (Checks use it to demand a clear error on bad input.)"""
    try:
        fn()
    except error:
        return True
    return False
