"""The preparation path every front end shares: a typed chat, completion or infill request
(parsed at its route) prepared once into a frozen ``Prepared`` (chat rendering, tool calls,
structured output, logprobs, fill-in-the-middle, the model and its QoS class), so a new front
end maps its own request onto the chat request and adds only its routes and reply shapes."""
