"""The Spark conversation server: settings, app factory, Spark endpoints, health, CLI."""
