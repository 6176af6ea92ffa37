"""Suites, qualification, comparison and reports: the layer users drive. Runs models only
through the harness (``suite → harness → workloads``)."""
