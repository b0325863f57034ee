"""Request and engine metrics: stats records (`stats`), stat loggers (`loggers`, `prometheus`)."""
