"""Shared by the tests: live servers, a real PostgreSQL, the transformers reference and
the torch-free fake runner (named in every test that uses it)."""
