"""rljob_operator: the kopf operator that turns RLJob resources into running training jobs.

Importing the package is cheap: kopf and the Kubernetes client load only in `handlers` and
`kube`, so the CRD generator and the pure renderers run without them.
"""
