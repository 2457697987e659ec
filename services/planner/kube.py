"""Replica counts through the Kubernetes API: the ``scale`` subresource of a Deployment, nothing else.

Uses the official ``kubernetes`` client with in-cluster config inside a pod, or
the kubeconfig outside one. The chart's RBAC grants exactly get/patch on
``deployments/scale`` of the two pools.
"""

from __future__ import annotations

import os

from kubernetes import client, config


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster credentials when running in a pod, else ``kubeconfig`` (or ``$KUBECONFIG``)."""
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config(config_file=kubeconfig)
    return client.ApiClient()


class DeploymentScaler:
    """Reads and sets ``spec.replicas`` of Deployments in one namespace."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.apps = client.AppsV1Api(api)
        self.namespace = namespace

    def replicas(self, deployment: str) -> int:
        scale = self.apps.read_namespaced_deployment_scale(deployment, self.namespace)
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    def set_replicas(self, deployment: str, replicas: int) -> None:
        self.apps.patch_namespaced_deployment_scale(deployment, self.namespace, {"spec": {"replicas": replicas}})
