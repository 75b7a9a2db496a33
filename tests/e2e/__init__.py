"""Tests against the local control plane (kube-apiserver + etcd + kwok); every one is marked `e2e`."""
