"""The package version (one place; ``positronic_brain.__version__`` re-exports it)."""
__version__ = "0.1.0"
