"""What the tests compare against: `reference`, the pure-torch oracle of every op, and
`cache_model`, a plain-Python model of the slot cache for the property-based tests."""
