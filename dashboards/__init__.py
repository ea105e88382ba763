"""Grafana dashboards as code: declared in definitions.py, rendered to json/."""
