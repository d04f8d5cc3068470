"""Parts of docs/ that the code writes, each module run as `python -m optimize.docs.NAME`."""
