"""What TensorBoard shows of a run's event files, read by TensorBoard's own code: its event
loader for the TEXT tab's config, and its hparams plugin's backend (the handlers behind the
HPARAMS tab's requests) for the sessions and their metrics."""

from __future__ import annotations

from pathlib import Path

from tensorboard import context
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.plugins import base_plugin
from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment, list_session_groups
from tensorboard.util import tensor_util


def texts(logdir: Path, tag: str) -> list[str]:
    """Every value of the text summary ``tag`` in the event files of ``logdir``, in order."""
    found = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == tag and value.metadata.plugin_data.plugin_name == "text":
                    found.append(tensor_util.make_ndarray(value.tensor).item().decode())
    return found


def hparams_view(logdir: Path) -> tuple[api_pb2.Experiment, api_pb2.ListSessionGroupsResponse]:
    """The HPARAMS tab's experiment (hparams and metrics) and its session groups, every column."""
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    tb = base_plugin.TBContext(logdir=str(logdir), multiplexer=multiplexer, data_provider=provider)
    backend, ctx = backend_context.Context(tb), context.RequestContext()
    experiment = get_experiment.Handler(ctx, backend, "", api_pb2.GetExperimentRequest()).run()
    request = api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=100,
                                               allowed_statuses=list(api_pb2.Status.values()))  # fmt: skip
    for info in experiment.hparam_infos:
        request.col_params.add(hparam=info.name)
    for metric in experiment.metric_infos:
        request.col_params.add(metric=metric.name)
    return experiment, list_session_groups.Handler(ctx, backend, "", request).run()
