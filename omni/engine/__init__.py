"""The inference engine that model instances run (pure-torch CPU path today)."""
