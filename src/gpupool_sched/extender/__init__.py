"""kube-scheduler extender mode: the placement core, the live state and the handshake behind
kube-scheduler's HTTP extender verbs (filter, prioritize, preempt, bind). See docs/extender.md."""
