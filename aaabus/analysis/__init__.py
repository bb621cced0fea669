"""What the traces of a bus say: causality domains planned from observed traffic (``aaabus plan``)
and the growth laws of timing traces (``aaabus analyze``), both Spark jobs.

A layer of its own, above the runtime: it reads the runtime's configuration (``a3.xml``, the
servers–domains tree, the generated layouts) and the traffic schema its recorder writes, and no
runtime module imports it (``lint-imports`` checks both). Its libraries are the ``spark`` extra
(``pip install 'aaabus[spark]'``: pyspark, pyarrow, numpy, networkx, matplotlib), imported
inside the functions that use them; each command checks first that they are installed
(:func:`aaabus.extras.require`) and otherwise says, in one line, which extra to install.

* ``plan``, ``analyze``: the two commands (options, run), shared by the ``aaabus`` command line
  and the checkout's ``python -m perf plan|analyze``;
* ``traffic_matrix``, ``planner``, ``costmodel``: traffic traces to a matrix, the matrix to
  domains, the predicted cost of a layout;
* ``sparkjob``, ``schema``, ``report``: what both jobs share, the traces' Parquet schemas, the
  analysis's plots and ``report.md``.
"""
