"""Errors the user can act on. Each becomes one line on stderr and exit code 2."""


class RecipeError(Exception):
    """The recipe, an override or an input is wrong. Raised before anything is written."""
