"""The ``tiercache`` command line (:mod:`tiercache.cli.app`): the only place errors become exit codes.

One module per subcommand — :mod:`~tiercache.cli.server` (``server``, ``config docs``),
:mod:`~tiercache.cli.inspect` (with its data sources, :mod:`~tiercache.cli.sources`, and its
tables, :mod:`~tiercache.cli.inspect_views`),
:mod:`~tiercache.cli.ops` (``clear``, ``warm``), :mod:`~tiercache.cli.bench` (with its
measurements, :mod:`~tiercache.cli.measure`) — plus :mod:`~tiercache.cli.connection` (reaching a
live server) and :mod:`~tiercache.cli.output` (bytes, JSON, tables, progress).
"""
