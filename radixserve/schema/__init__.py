"""Request schemas shared by the HTTP routes and the Python API (pydantic)."""
