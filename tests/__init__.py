"""gpupool's tests, a package so that the test support code imports as `tests.support` from the repo root
(pytest, `python -m benchmarks...`, hack/ scripts). See tests/support/__init__.py."""
