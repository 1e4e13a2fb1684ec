"""The local service's API contract tests (tests/env/test_service_api.py), run unchanged against the service on the
Kubernetes backend (emulated API server, real agent processes in the simulated pods): our client and the requests
Orchard Env's own client sends get the same answers from either backend. Left out, by what the backend is: the
terminal tests (the Kubernetes backend offers no terminals; exec only), and the tests of the local service's own
command line and in-process fast path. The fixtures (one service for the module, a client, a fresh sandbox) are the directory's
conftest's, as for test_k8s_service.py."""

from __future__ import annotations

from test_service_api import (  # noqa: F401  (collected here, with this module's fixtures)
    test_apply_patch_applies_the_diff_as_data,
    test_bad_base64_is_400,
    test_create_rejects_bad_input,
    test_every_non_health_route_requires_the_key,
    test_exec_cwd_env_and_stdin,
    test_exec_on_missing_sandbox_is_404,
    test_exec_timeout_and_output_cap,
    test_exec_wait_false_then_poll_and_server_side_wait,
    test_exec_wait_true_returns_the_finished_job,
    test_execs_in_one_sandbox_run_one_at_a_time,
    test_idempotency_key_returns_the_first_result,
    test_lifecycle_create_get_wait_heartbeat_delete,
    test_orchard_env_client_request_shapes,
    test_path_escapes_are_refused_with_400,
    test_upload_archive_refuses_every_escape_with_the_file_apis_error,
    test_upload_archive_refuses_what_is_no_tar_and_bad_base64,
    test_upload_archive_unpacks_a_tree_as_the_sandbox_user,
    test_upload_download_list_roundtrip,
)

