"""One consumer process: the loop, intake, batching, the row limit, replies, recovery,
dead letters, alerts, the result cache, result checks and hot swap.

Import the modules themselves (``inferfleet.worker.serving.consumer``): this
package re-exports nothing, so importing a light module (intake, batching)
does not import torch through the runtime.
"""
