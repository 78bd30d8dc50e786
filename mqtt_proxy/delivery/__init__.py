"""Delivery: the pull side, light queue → connections: the queue cache, QoS 0 cohorts, QoS 1 runs, shared groups, outbound aliases."""
