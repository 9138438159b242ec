"""Query operators over Arrow batch streams, one per file."""
