"""Shared by every test. Its folder is on sys.path, so tests in tests/unit and tests/e2e import `helpers`."""
