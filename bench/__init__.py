"""The benchmarks: each module is run from the repository root as `python -m bench.<name>`.

bench/ is a package that is not installed (pyproject's setuptools include is edgeflux*, stages* and
pipeline*): `python -m` puts the current directory on sys.path, so `bench`, `edgeflux`, `stages` and
`pipeline` import from the repository root. Each module's docstring gives its commands (`--help`).
"""
