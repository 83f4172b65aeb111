# The repository root's conftest.py: pytest puts this directory on sys.path, so the
# tests import the package from here.
