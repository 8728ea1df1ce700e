"""Tools outside the library: test fixtures and harnesses (nothing here is imported by the packages)."""
