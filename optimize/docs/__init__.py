"""Documentation made from the code: the tables in docs/ (tables.py)."""
