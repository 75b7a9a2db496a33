"""Generated kubelet device plugin API stubs (see proto/ and hack/gen_proto.py)."""
