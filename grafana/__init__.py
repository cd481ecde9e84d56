"""Grafana dashboard generator, provisioning, Prometheus config and alert rules (see docs/grafana.md)."""
