"""Routing policies (length prediction, lanes, model choice): pure objects, no Ray."""
