"""Generated kubelet API stubs (see proto/ and hack/gen_proto.py)."""
