"""One checks file per chapter, `chNN.py`: top-level `check_<claim>(module)` functions that raise
when the module under test gets something wrong. `exercises.run_checks` finds and runs them."""


def raises(fn, error: type[Exception]) -> bool:
    """Does calling `fn()` raise `error`? (Checks use it to demand a clear error on bad input.)"""
    try:
        fn()
    except error:
        return True
    return False


def raises_naming(field: str, call, what: str) -> None:
    """``call()`` must raise a ValueError whose message names ``field``
    (a clear error on bad input)."""
    try:
        call()
    except ValueError as err:
        assert field in str(err), f"{what}: the ValueError should name {field!r}, it says {err}"
        return
    raise AssertionError(f"{what}: expected a ValueError naming {field!r}, nothing was raised")
