"""The documents in docs/ that are made from the code and from measured records."""
