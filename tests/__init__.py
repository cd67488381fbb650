"""The test suite: regular packages (tests.unit, tests.integration, tests.e2e, tests.support), so
two test files may share a basename (unit/ and integration/ both hold test_operator_hardening.py)
and every module has one name for pytest and mypy alike."""
