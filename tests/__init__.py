"""The test suite is one package, so its folders (kernels, formats, gpu, ...) never stand in for
installed top-level modules of the same name: transformers imports the `kernels` distribution
when it is installed, and a test folder found first on sys.path would break that import."""
