"""carpool's Grafana dashboards, declared as data.

Every query reads series that carpool or Ray Serve emits (a unit test checks the names against
the metric registries, and an integration test runs every query against a real Prometheus).
"""

from __future__ import annotations

from dashboards.spec import APP, DEP, Dashboard, Panel, Target

RATE = "1m"


def quantiles(
    metric: str, by: str, selector: str, qs: tuple[float, ...] = (0.5, 0.99)
) -> list[Target]:
    return [
        Target(
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"p{int(q * 100)} {{{{{by}}}}}",
        )
        for q in qs
    ]


def mean(metric: str, by: str, selector: str) -> Target:
    return Target(
        f"sum by ({by}) (rate({metric}_sum{{{selector}}}[{RATE}])) / "
        f"sum by ({by}) (rate({metric}_count{{{selector}}}[{RATE}]))",
        f"mean {{{{{by}}}}}",
    )


OVERVIEW = Dashboard(
    uid="carpool-overview",
    title="carpool / Overview",
    description="Requests, latency and errors per pipeline (Serve application) and route.",
    panels=[
        Panel(
            "Requests/s per pipeline",
            [
                Target(
                    f"sum by (application) (rate(ray_serve_num_http_requests_total{{{APP}}}[{RATE}]))",
                    "{{application}}",
                )
            ],
            unit="reqps",
        ),
        Panel(
            "HTTP latency per pipeline",
            quantiles("ray_serve_http_request_latency_ms", "application", APP),
            unit="ms",
        ),
        Panel(
            "Errors/s per pipeline and code",
            [
                Target(
                    "sum by (application, error_code) "
                    f"(rate(ray_serve_num_http_error_requests_total{{{APP}}}[{RATE}]))",
                    "{{application}} {{error_code}}",
                )
            ],
            unit="reqps",
        ),
        Panel(
            "Requests/s per route",
            [
                Target(
                    f"sum by (route) (rate(ray_serve_num_http_requests_total{{{APP}}}[{RATE}]))",
                    "{{route}}",
                )
            ],
            unit="reqps",
        ),
    ],
)

BATCHING = Dashboard(
    uid="carpool-batching",
    title="carpool / Batching",
    description="What batching decided, per model deployment: batch and pass sizes, padding, "
    "queue wait against forward time, and Ray Serve's own batch metrics.",
    panels=[
        Panel(
            "Items per forward pass",
            [
                *quantiles("ray_carpool_forward_items", "deployment", DEP, (0.5, 0.9)),
                mean("ray_carpool_forward_items", "deployment", DEP),
            ],
        ),
        Panel(
            "Items per batch (merged step)",
            [
                *quantiles("ray_carpool_step_items", "deployment", DEP, (0.5, 0.9)),
                mean("ray_carpool_step_items", "deployment", DEP),
            ],
        ),
        Panel(
            "Padded tokens per forward pass",
            quantiles("ray_carpool_forward_padded_tokens", "deployment", DEP, (0.5, 0.9)),
        ),
        Panel(
            "Padding waste",
            [
                Target(
                    f"1 - sum by (deployment) (rate(ray_carpool_real_tokens_total{{{DEP}}}[5m])) / "
                    f"sum by (deployment) (rate(ray_carpool_padded_tokens_total{{{DEP}}}[5m]))",
                    "last 5m {{deployment}}",
                ),
                Target(
                    f"max by (deployment) (ray_carpool_padding_waste_ratio{{{DEP}}})",
                    "since start {{deployment}}",
                ),
            ],
            unit="percentunit",
        ),
        Panel(
            "Queue wait vs forward time",
            [
                *quantiles("ray_carpool_queue_wait_ms", "deployment", DEP),
                *quantiles("ray_carpool_forward_time_ms", "deployment", DEP),
            ],
            unit="ms",
            description="First pair: arrival at the replica to the start of the item's pass. "
            "Second pair: one forward pass.",
        ),
        Panel(
            "Tokens/s computed (real vs padded)",
            [
                Target(
                    f"sum by (deployment) (rate(ray_carpool_real_tokens_total{{{DEP}}}[{RATE}]))",
                    "real {{deployment}}",
                ),
                Target(
                    f"sum by (deployment) (rate(ray_carpool_padded_tokens_total{{{DEP}}}[{RATE}]))",
                    "padded {{deployment}}",
                ),
            ],
        ),
        Panel(
            "Ray Serve: batch wait and execution time",
            [
                *quantiles("ray_serve_batch_wait_time_ms", "deployment", DEP, (0.5,)),
                *quantiles("ray_serve_batch_execution_time_ms", "deployment", DEP, (0.5,)),
            ],
            unit="ms",
        ),
        Panel(
            "Ray Serve: batches/s and batch queue",
            [
                Target(
                    f"sum by (deployment) (rate(ray_serve_batches_processed_total{{{DEP}}}[{RATE}]))",
                    "batches/s {{deployment}}",
                ),
                Target(
                    f"sum by (deployment) (ray_serve_batch_queue_length{{{DEP}}})",
                    "queued {{deployment}}",
                ),
            ],
        ),
    ],
)

GENERATION = Dashboard(
    uid="carpool-generation",
    title="carpool / Generation",
    description="Generator replicas: throughput, time to first token, time per output token, "
    "running vs waiting sequences, KV cache use.",
    panels=[
        Panel(
            "Output tokens/s",
            [
                Target(
                    "sum by (deployment) "
                    f"(rate(ray_carpool_generator_output_tokens_total{{{DEP}}}[{RATE}]))",
                    "{{deployment}}",
                )
            ],
        ),
        Panel(
            "Time to first token",
            quantiles("ray_carpool_generator_time_to_first_token_ms", "deployment", DEP),
            unit="ms",
        ),
        Panel(
            "Time per output token",
            quantiles("ray_carpool_generator_time_per_output_token_ms", "deployment", DEP),
            unit="ms",
        ),
        Panel(
            "Running vs waiting sequences",
            [
                Target(
                    f"sum by (deployment) (ray_carpool_generator_running_seqs{{{DEP}}})",
                    "running {{deployment}}",
                ),
                Target(
                    f"sum by (deployment) (ray_carpool_generator_waiting_seqs{{{DEP}}})",
                    "waiting {{deployment}}",
                ),
            ],
        ),
        Panel(
            "KV blocks used / total",
            [
                Target(
                    f"sum by (deployment) (ray_carpool_generator_kv_blocks_used{{{DEP}}})",
                    "used {{deployment}}",
                ),
                Target(
                    f"sum by (deployment) (ray_carpool_generator_kv_blocks_total{{{DEP}}})",
                    "total {{deployment}}",
                ),
            ],
        ),
        Panel(
            "Prefill vs decode time per step",
            [
                *quantiles("ray_carpool_generator_prefill_time_ms", "deployment", DEP, (0.5,)),
                *quantiles("ray_carpool_generator_decode_time_ms", "deployment", DEP, (0.5,)),
            ],
            unit="ms",
        ),
        Panel(
            "Tokens per step",
            [mean("ray_carpool_generator_step_tokens", "deployment", DEP)],
        ),
        Panel(
            "Sequences in a decode step",
            [*quantiles("ray_carpool_generator_decode_batch_seqs", "deployment", DEP, (0.5, 0.9))],
        ),
    ],
)

ROUTER = Dashboard(
    uid="carpool-router",
    title="carpool / Router",
    description="What the router decided for model=auto: model and lane per request, "
    "escalations, overflow, length-prediction error, time waiting in lanes.",
    panels=[
        Panel(
            "Decisions/s by model and lane",
            [
                Target(
                    "sum by (model, lane) "
                    f"(rate(ray_carpool_router_decisions_total{{{APP}}}[{RATE}]))",
                    "{{model}} / {{lane}}",
                )
            ],
            unit="reqps",
        ),
        Panel(
            "Escalations and overflows/s",
            [
                Target(
                    f"sum (rate(ray_carpool_router_escalations_total{{{APP}}}[{RATE}]))",
                    "escalated to large",
                ),
                Target(
                    f"sum (rate(ray_carpool_router_overflows_total{{{APP}}}[{RATE}]))",
                    "overflowed to small",
                ),
            ],
            unit="reqps",
        ),
        Panel(
            "Predicted output tokens by lane",
            quantiles("ray_carpool_router_predicted_tokens", "lane", APP, (0.5, 0.9)),
        ),
        Panel(
            "Length prediction error |log(1+pred) - log(1+actual)|",
            quantiles("ray_carpool_router_prediction_error_log", "model", APP, (0.5, 0.9)),
        ),
        Panel(
            "Time waiting in lanes",
            quantiles("ray_carpool_router_lane_queue_ms", "lane", APP),
            unit="ms",
        ),
    ],
)

CAPACITY = Dashboard(
    uid="carpool-capacity",
    title="carpool / Capacity",
    description="Replicas per deployment, autoscaling targets, load on replicas, failures.",
    panels=[
        Panel(
            "Healthy replicas per deployment",
            [
                Target(
                    "sum by (application, deployment) "
                    f"(ray_serve_deployment_replica_healthy{{{APP}}})",
                    "{{application}}/{{deployment}}",
                )
            ],
        ),
        Panel(
            "Autoscaling target replicas",
            [
                Target(
                    "max by (application, deployment) "
                    f"(ray_serve_autoscaling_target_replicas{{{APP}}})",
                    "{{application}}/{{deployment}}",
                )
            ],
        ),
        Panel(
            "Ongoing requests at replicas",
            [
                Target(
                    f"sum by (deployment) (ray_serve_num_ongoing_requests_at_replicas{{{DEP}}})",
                    "{{deployment}}",
                )
            ],
        ),
        Panel(
            "Processing latency per deployment",
            quantiles("ray_serve_deployment_processing_latency_ms", "deployment", DEP),
            unit="ms",
        ),
        Panel(
            "Error responses/s (4xx client, 5xx server)",
            [
                Target(
                    "sum by (application, error_code) "
                    f"(rate(ray_serve_num_deployment_http_error_requests_total{{{APP}}}[5m]))",
                    "{{application}} {{error_code}}",
                )
            ],
            unit="reqps",
        ),
        Panel(
            "Items dropped before compute/s (refused 503, deadline 504, client cancelled)",
            [
                Target(
                    "sum by (deployment, reason) "
                    f"(rate(ray_carpool_dropped_items_total{{{DEP}}}[5m]))",
                    "{{deployment}} {{reason}}",
                )
            ],
        ),
        Panel(
            "Replica starts",
            [
                Target(
                    f"sum by (deployment) (ray_serve_deployment_replica_starts_total{{{DEP}}})",
                    "{{deployment}}",
                )
            ],
        ),
    ],
)

DASHBOARDS = [OVERVIEW, BATCHING, GENERATION, ROUTER, CAPACITY]
