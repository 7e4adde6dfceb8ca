"""zerokit inside the trainers people already use. Each integration is imported on its own
(``from zerokit.integrations.lightning import ZeroKitStrategy``): importing ``zerokit`` or this
package imports no trainer."""
