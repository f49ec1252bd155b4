"""Reference answers to the exercises: the same signatures as the stubs in `exercises/`.

Try the exercise first; `python -m exercises check chNN --solutions` shows what passing looks like.
"""
