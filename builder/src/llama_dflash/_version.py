# dfbuild writes the real version here in its staged copy of builder/.
__version__ = "0.0.0"
