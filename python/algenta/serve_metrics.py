"""``GET /metrics`` of ``algenta serve``, in Prometheus's text format (``prometheus_client``):
requests by route and status, tokens in and out, the wait queue and the slots in use, and
latency histograms of the first token and between tokens. Each application has its own
registry, so several servers in one process (the tests) count apart."""

from __future__ import annotations

# Buckets for a CPU server: a first token within 10 ms to a minute (a long prompt queued), and
# 1 ms to 5 s between two tokens.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, scheduler, model: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.sched = scheduler
        self.registry = r = CollectorRegistry()
        self.requests = Counter("algenta_requests", "HTTP requests answered, by route and "
                                "status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("algenta_prompt_tokens", "prompt tokens of the requests "
                                     "served", registry=r)
        self.generation_tokens = Counter("algenta_generation_tokens", "tokens generated",
                                         registry=r)
        self.waiting = Gauge("algenta_queue_length", "requests waiting for a slot", registry=r)
        self.active = Gauge("algenta_slots_in_use", "slots decoding or being filled",
                            registry=r)
        self.slots = Gauge("algenta_slots", "the session's slots", registry=r)
        self.ttft = Histogram("algenta_time_to_first_token_seconds", "from the request's "
                              "arrival to its first generated token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("algenta_inter_token_latency_seconds", "between two tokens of one "
                             "output", buckets=ITL_BUCKETS, registry=r)
        info = Gauge("algenta_model_info", "the model served", ["model"], registry=r)
        info.labels(model=model).set(1)

    def render(self) -> tuple:
        """(body, content type) of a scrape; the queue and slots read now."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        load = self.sched.load()
        self.waiting.set(load["waiting"])
        self.active.set(load["active"])
        self.slots.set(load["slots"])
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
