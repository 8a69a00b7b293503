"""Suites: reading suite files (schema, shared files, packaged suites) and expanding them into runs."""
