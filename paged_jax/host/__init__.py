"""Host side: NumPy and Python only, nothing traced. Allocation, sharing, caching, scheduling."""
