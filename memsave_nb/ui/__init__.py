"""The user interface: pure Bokeh figure builders (``figures``), number formatting (``format``),
and the notebook explorer. Import the submodules you need; this package imports nothing heavy."""
