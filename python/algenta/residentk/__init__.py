"""residentk: would a resident GPU decode session hold this model shape, and what would it cost."""
