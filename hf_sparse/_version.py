"""The package's version, one home for ``hf_sparse.__version__`` and the files it writes."""
__version__ = "0.1.0"
