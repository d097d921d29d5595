"""Tools built on the library: the ``reshard`` command (``plan``, ``bench``,
``demo``). Nothing in the library imports them."""
