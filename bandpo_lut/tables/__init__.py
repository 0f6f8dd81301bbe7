"""The bound tables: divergences, the `.bplut` file format, loading the shipped tables, the mpmath solver, and the library halves of table generation and verification (no compiled code, no CLI)."""
